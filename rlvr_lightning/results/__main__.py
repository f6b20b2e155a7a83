"""`python -m rlvr_lightning.results` (`make results`): see the package's docstring and its flags' --help."""

from rlvr_lightning.results import main

if __name__ == "__main__":
    main()
