"""`python -m data_prep.demo_corpus`, where users know it; the code is in data_prep/reading/."""

from data_prep.reading.demo_corpus import main

if __name__ == "__main__":
    raise SystemExit(main())
