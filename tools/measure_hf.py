#!/usr/bin/env python3
"""measure.py (../shared/groundtruth) on the CPU, with the named inputs of tools/hf_inputs.py.

Usage (with the ground-truth venv): measure_hf.py CASES.json OUT.json [ID ...]
Cases without an `inputs` key are measured exactly as measure.py measures them.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GT = os.environ.get("MEMEST_GROUNDTRUTH", os.path.join(HERE, "..", "..", "shared", "groundtruth"))
if not os.path.isdir(GT):
    GT = "/work/shared/groundtruth"
sys.path.insert(0, GT)
sys.path.insert(0, HERE)

import measure  # noqa: E402

import hf_inputs  # noqa: E402

if __name__ == "__main__":
    hf_inputs.extend(measure)
    measure.main()
