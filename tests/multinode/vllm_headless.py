"""``vllm serve --headless`` for the CPU wheel (whose ``vllm`` CLI fails on its version
lookup): the worker processes of a multi-node vLLM instance's secondary node.

    python tests/multinode/vllm_headless.py --model M --nnodes 2 --node-rank 1 ...
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    run_headless(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]))
