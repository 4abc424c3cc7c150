"""A fresh vLLM instance loaded from a checkpoint: the outputs a sync must reproduce.

usage: reference.py MODEL_DIR OUT_JSON [LLM_KWARGS_JSON]
"""

import json
import sys

from wtransfer_vllm.testing import checksums, greedy, llm_kwargs, write_json

if __name__ == "__main__":
    model_dir, out = sys.argv[1:3]
    from vllm import LLM

    llm = LLM(**llm_kwargs(model_dir, **(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})))
    write_json(out, {"outputs": greedy(llm), "checksums": checksums(llm)})
