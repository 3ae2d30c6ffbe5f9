"""What pass_grid.py and steady_rounds.py decode with: the server's batched decoder (`BatchDecoder`) on the default
pair in float32, compiled, one thread, with the widths of `specdec serve --gamma 4` (1, 3 and 5 inputs a row), and
32 held-out 64-token `code` prompts."""

import torch

import specdec
from specdec.bench.workloads import load_workload
from specdec.engine.batch import BatchDecoder


def server_decoder() -> tuple[BatchDecoder, list[list[int]]]:
    torch.set_num_threads(1)
    target, draft, tokenizer = specdec.load_default(dtype="float32")
    prompts = [list(p.ids) for p in load_workload("code", tokenizer, 32, prompt_tokens=64)]
    decoder = BatchDecoder(target, specdec.DraftModel(draft), compile=True, max_len=512)
    decoder.target.query_buckets = (1, 3, 5)  # the server's widths at γ 0 / 2 / 4
    return decoder, prompts
