"""`python -m plugserve.bench`: the same as `plugserve bench serve`."""

import sys

from plugserve.bench.client import build_parser, main

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
