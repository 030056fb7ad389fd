"""`python -m vismmoe_edge.cli ...`: the same command as the `vismmoe-edge` entry point."""

from vismmoe_edge.cli import main

main()
