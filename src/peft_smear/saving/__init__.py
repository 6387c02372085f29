"""What a SMEAR adapter becomes on disk and on the Hub, built on the PEFT method: atomic directory writes, the
atomic ``save_pretrained``, the model cards (rendered from templates) and ``push_to_hub``."""
