"""What leaves the SMEAR model for plain PEFT and servers, built on the PEFT method: the merged expert of a fixed
routing as an adapter with one expert, PEFT's merges of a bank's experts, and the check that an export is what
multi-LoRA servers load."""
