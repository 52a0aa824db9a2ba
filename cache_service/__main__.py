"""`python -m stagemesh.cache_service ...`: the cache service without the stagemesh CLI."""

import argparse

from stagemesh.cache_service.server import add_arguments, main

parser = argparse.ArgumentParser(
    prog="python -m stagemesh.cache_service", description="stagemesh runtime-weight cache service"
)
add_arguments(parser)
main(parser.parse_args())
