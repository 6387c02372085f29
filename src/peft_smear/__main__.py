"""``python -m peft_smear``: the ``peft-smear`` command."""

from peft_smear_launcher import main


raise SystemExit(main())
