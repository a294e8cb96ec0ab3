"""`python -m data_prep.clean`, where users know it; the code is in data_prep/quality/cleaning/."""

from data_prep.quality.cleaning.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
