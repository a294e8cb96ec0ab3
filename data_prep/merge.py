"""`python -m data_prep.merge`, where users know it; the code is in data_prep/parts/."""

from data_prep.parts.merge import main

if __name__ == "__main__":
    raise SystemExit(main())
