"""A chat model's own greedy answers to the offline questions of tools/chat_prompts.py: the
training data of its EAGLE-3 head (tools/train_eagle3.py --data file).

    nice -n 10 python -m tools.chat_answers --model smollm2 --split train \
        --out /tmp/smollm2_answers.jsonl --minutes 30

specd itself generates them (`EngineCore`, speculation off, continuous batching of
`--concurrency` requests): batched greedy decoding is what it is fast at. Each question is
rendered with the model's chat template (transformers' `apply_chat_template`, the system
prompt the template adds by default) and answered greedily up to `--max-tokens` tokens or
the end of the turn. One JSON line per answer, written as it finishes (so a run stopped by
its time box keeps what it made): family, question, prompt_ids, answer_ids (the end-of-turn
token included when reached), finish_reason. The time box stops admitting questions; the
answers in flight are finished.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.named_models import ensure_imported, named_model
from tools.chat_prompts import questions


def chat_prompt_ids(model_dir: Path, questions_: list[str]) -> list[list[int]]:
    """Each question as one user turn in the model's chat template, with the generation
    prompt, as token ids (the template's text tokenized without added special tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False)
             for q in questions_]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def resolve_model_dir(model: str) -> Path:
    """A named model's directory (imported first if it is a GGUF import), or the path."""
    named = named_model(model)
    if named is None:
        return Path(model)
    ensure_imported(named)
    return named.model_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model's name or directory")
    p.add_argument("--split", choices=("train", "heldout"), default="train")
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=30.0, help="stop admitting questions after")
    p.add_argument("--max-questions", type=int, default=100_000)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a shared machine two threads spin on each other)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    rows = questions(args.split)[: args.max_questions]
    prompts = chat_prompt_ids(model_dir, [r["question"] for r in rows])
    core = EngineCore(EngineConfig(model=str(model_dir), dtype=args.dtype,
                                   speculative_algorithm=None, max_num_seqs=args.concurrency))
    params = SamplingParams(max_tokens=args.max_tokens)  # greedy (temperature 0)
    t0 = time.time()
    deadline = t0 + args.minutes * 60
    answers: dict[str, list[int]] = {}
    next_row, num_done, num_tokens = 0, 0, 0
    with Path(args.out).open("w") as out:
        while core.has_unfinished() or (next_row < len(rows) and time.time() < deadline):
            while (next_row < len(rows) and len(answers) < args.concurrency
                   and time.time() < deadline):
                request_id = str(next_row)
                core.add_request(request_id, prompts[next_row], params)
                answers[request_id] = []
                next_row += 1
            for delta in core.step():
                answers[delta.request_id].extend(delta.new_token_ids)
                if delta.finish_reason is None:
                    continue
                i = int(delta.request_id)
                ids = answers.pop(delta.request_id)
                out.write(json.dumps({**rows[i], "prompt_ids": prompts[i], "answer_ids": ids,
                                      "finish_reason": delta.finish_reason}) + "\n")
                out.flush()
                num_done += 1
                num_tokens += len(ids)
                if num_done % 50 == 0:
                    secs = time.time() - t0
                    print(f"{num_done} answers, {num_tokens} tokens, {secs:.0f}s "
                          f"({num_tokens / secs:.1f} tok/s)", flush=True)
    secs = time.time() - t0
    print(f"wrote {num_done} answers ({num_tokens} tokens) to {args.out} in {secs:.0f}s")


if __name__ == "__main__":
    main()
