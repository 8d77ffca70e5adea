"""Train the embedded fixture model: a byte-level BPE tokenizer and a small Llama.

The corpus is the Python standard library's source on this machine (test folders excluded).
A deterministic slice of files (by a hash of the relative path) is held out: it is never
trained on, it gives the evaluation loss, and the speculation and benchmark tools draw their
prompts from it. The output is a standard Hugging Face model directory that transformers'
`AutoModelForCausalLM` and `AutoTokenizer` load as they are, plus `train_log.jsonl` (the
loss curve) and `heldout_files.txt`.

    python tools/train_fixture.py --out workers/fixture

The committed fixture is this command's output with the defaults (5M tokens, batch 16 x 256,
2 threads: 49 minutes on the 2-core VM, held-out loss 3.80 nats/token). Deterministic given
`--seed` (and the same stdlib and torch build). Retrain the EAGLE-3 head after it
(`tools/train_eagle3.py`): the head reads this model's hidden states.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|endoftext|>"
# ChatML, as the Qwen models render it; transformers renders it identically.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}
HELDOUT_MODULUS = 20  # one file in 20 is held out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """A file is held out when the first byte of sha1(relpath) falls in 1/20 of the range."""
    return hashlib.sha1(relpath.encode()).digest()[0] % HELDOUT_MODULUS == 0


def corpus_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files), both sorted by relative path."""
    train: list[Path] = []
    heldout: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_PARTS.intersection(rel.parts) or rel.name.startswith("test_"):
            continue
        (heldout if is_heldout(rel.as_posix()) else train).append(path)
    return train, heldout


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_text(p) for p in files), trainer=trainer)
    return tok


def encode_files(tok, files: list[Path]) -> torch.Tensor:
    """All files' token ids, each followed by the end-of-text token, as one int64 tensor."""
    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tok.encode_batch([read_text(p) for p in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def write_tokenizer_files(tok, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def model_config(args: argparse.Namespace, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position,
        rope_theta=10000.0,  # type: ignore[call-arg]  # accepted via **kwargs (legacy name)
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, num_batches: int, batch: int) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(num_batches):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        x = batch_at(data, starts, seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        losses.append(
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        )
    model.train()
    return float(torch.stack(losses).mean())


def train(args: argparse.Namespace) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = stdlib_root()
    train_files, heldout_files = corpus_files(root)
    print(f"corpus: {len(train_files)} train files, {len(heldout_files)} held out ({root})")
    rel = [p.relative_to(root).as_posix() for p in heldout_files]
    (out / "heldout_files.txt").write_text("\n".join(rel) + "\n")

    t0 = time.time()
    tok = train_tokenizer(train_files, args.vocab_size)
    write_tokenizer_files(tok, out, args.max_position)
    train_ids = encode_files(tok, train_files)
    val_ids = encode_files(tok, heldout_files)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, {len(train_ids):,} train tokens, "
          f"{len(val_ids):,} held-out tokens ({time.time() - t0:.0f}s)")

    eos_id = tok.token_to_id(EOS_TOKEN)
    model = LlamaForCausalLM(model_config(args, eos_id))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    tokens_per_step = args.batch * args.seq_len
    total_steps = max(1, args.tokens // tokens_per_step)
    gen = torch.Generator().manual_seed(args.seed)
    log = (out / "train_log.jsonl").open("w")
    t_start = time.time()
    model.train()
    for step in range(total_steps):
        lr = lr_at(step, total_steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch,), generator=gen)
        x = batch_at(train_ids, starts, args.seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        record: dict[str, float | int] = {
            "step": step + 1, "tokens": (step + 1) * tokens_per_step,
            "loss": round(loss.item(), 4), "lr": lr, "elapsed_s": round(time.time() - t_start, 1),
        }
        last = step + 1 == total_steps
        if (step + 1) % args.eval_every == 0 or last:
            record["heldout_loss"] = round(evaluate(model, val_ids, args.seq_len, 8, 8), 4)
        log.write(json.dumps(record) + "\n")
        log.flush()
        if (step + 1) % 10 == 0 or last or "heldout_loss" in record:
            rate = record["tokens"] / max(1e-9, time.time() - t_start)
            extra = f" heldout {record['heldout_loss']:.3f}" if "heldout_loss" in record else ""
            print(f"step {step + 1}/{total_steps} loss {float(loss):.3f}{extra} "
                  f"lr {lr:.2e} {rate:,.0f} tok/s", flush=True)
    log.close()
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers' stub types .to badly
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False,
    ).save_pretrained(out)
    print(f"wrote {out} in {time.time() - t0:.0f}s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="workers/fixture", help="output model directory")
    p.add_argument("--tokens", type=int, default=5_000_000, help="training tokens in all")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-position", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse_args(sys.argv[1:]))
