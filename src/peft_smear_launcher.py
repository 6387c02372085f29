"""The entry point of the ``peft-smear`` command (``peft_smear_launcher:main``).

It sits outside the :mod:`peft_smear` package because importing the package registers SMEAR with PEFT, which imports
torch, transformers and PEFT: seconds before any argument is read. Imported by :func:`main`, the package waits: the
command parses its arguments first, so that ``--help`` and a wrong argument answer at once, and loads the PEFT method
only to run (``tests/test_cli.py`` checks that parsing imports none of them). Importing this module changes nothing:
``import peft_smear`` elsewhere loads the whole package.
"""

from __future__ import annotations


PARSING = False
"""Whether :func:`main` is parsing a command line, during which :mod:`peft_smear` does not load the PEFT method."""


def main(argv: list[str] | None = None) -> int:
    global PARSING
    PARSING = True
    try:
        import peft_smear
        from peft_smear import cli

        args = cli.parse(argv)  # --help and argument errors exit here
    finally:
        PARSING = False
    peft_smear._load_method()
    return cli.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
