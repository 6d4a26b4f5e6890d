"""`python -m deepinfer ...`: the same command line as the `deepinfer` console script."""

from deepinfer.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
