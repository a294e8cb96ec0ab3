"""`python -m data_prep.preprocess`, where users know it; the code is in data_prep/preprocessing/."""

from data_prep.preprocessing.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
