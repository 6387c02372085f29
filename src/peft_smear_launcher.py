"""The entry point of the ``peft-smear`` command (``peft_smear_launcher:main``).

It sits outside the :mod:`peft_smear` package because importing the package registers SMEAR with PEFT, which imports
torch, transformers and PEFT: seconds before any argument is read. Imported from here, the package waits: the command
parses its arguments first, so that ``--help`` and a wrong argument answer at once, and loads the PEFT method only to
run (``tests/test_cli.py`` checks that parsing imports none of them).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    import peft_smear
    from peft_smear import cli

    args = cli.parse(argv)  # --help and argument errors exit here
    peft_smear._load_method()
    return cli.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
