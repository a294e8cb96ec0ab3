"""`python -m recipes.plan`: the planner's command line, at the path users know (the code is in recipes/planning/)."""

from recipes.planning.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
