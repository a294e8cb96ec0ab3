"""`python -m data_prep.train_tokenizer`, where users know it; the code is in data_prep/tokenizer/."""

from data_prep.tokenizer.training import main

if __name__ == "__main__":
    raise SystemExit(main())
