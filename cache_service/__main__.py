"""`python -m cache_service ...`: the cache service without the stagemesh CLI."""

import argparse

from cache_service.server import add_arguments, main

parser = argparse.ArgumentParser(prog="python -m cache_service", description="stagemesh runtime-weight cache service")
add_arguments(parser)
main(parser.parse_args())
