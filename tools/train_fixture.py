"""Train an embedded fixture model: a byte-level BPE tokenizer and a small Llama, or (with
`--arch deepseek_v3`) a small DeepSeek-V3 on an existing fixture's tokenizer.

The corpus is the Python standard library's source on this machine (test folders excluded).
A deterministic slice of files (by a hash of the relative path) is held out: it is never
trained on, it gives the evaluation loss, and the speculation and benchmark tools draw their
prompts from it. The output is a standard Hugging Face model directory that transformers'
`AutoModelForCausalLM` and `AutoTokenizer` load as they are, plus `train_log.jsonl` (the
loss curve) and `heldout_files.txt`.

    python -m tools.train_fixture --out workers/fixture

The committed fixture is this command's output with the defaults (5M tokens, batch 16 x 256,
2 threads: 49 minutes on the 2-core VM, held-out loss 3.80 nats/token). Deterministic given
`--seed` (and the same stdlib and torch build). Retrain the EAGLE-3 head after it
(`tools/train_eagle3.py`): the head reads this model's hidden states.

The MoE fixture (`specd --model fixture-moe`; figures in docs/benchmarks.md) is

    python -m tools.train_fixture --arch deepseek_v3 --tokenizer workers/fixture \
        --out workers/fixture-moe

the same corpus and tokenizer, and DeepSeek-V3's architecture at a small size: MLA with a
q LoRA, the first layer dense, then MoE layers of 8 routed experts (top-2, sigmoid scores,
`noaux_tc` choice with a correction bias) and a shared expert, YaRN rope. The correction
bias is trained as DeepSeek-V3 trains it, without an auxiliary loss (`ExpertBalancer`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
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
ARCHS = ("llama", "deepseek_v3")
# Per architecture, the defaults of the options left unset on the command line.
# bf16 autocast pays for itself on the dense model; on the MoE model its casts around the
# experts' small matmuls made training 3x slower than float32.
ARCH_DEFAULTS: dict[str, dict[str, int | float | str]] = {
    "llama": {"tokens": 5_000_000, "batch": 16, "lr": 2e-3, "hidden": 256,
              "intermediate": 688, "layers": 12, "precision": "bf16"},
    "deepseek_v3": {"tokens": 800_000, "batch": 8, "lr": 3e-3, "hidden": 128,
                    "intermediate": 320, "layers": 4, "precision": "fp32"},
}
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


def load_tokenizer(model_dir: Path):  # -> tokenizers.Tokenizer
    """An existing fixture's tokenizer (`--tokenizer`), to train another model on."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def model_config(args: argparse.Namespace, eos_id: int):
    """The transformers config of `--arch` at the options' sizes."""
    from transformers import DeepseekV3Config, LlamaConfig

    common = dict(vocab_size=args.vocab_size, hidden_size=args.hidden,
                  intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, max_position_embeddings=args.max_position,
                  tie_word_embeddings=False, bos_token_id=eos_id, eos_token_id=eos_id,
                  pad_token_id=eos_id)
    if args.arch == "llama":
        return LlamaConfig(
            **common,
            num_key_value_heads=args.kv_heads,
            rope_theta=10000.0,  # type: ignore[call-arg]  # accepted via **kwargs (legacy name)
            rms_norm_eps=1e-5,
        )
    # YaRN over the whole context: factor x the original length = max_position.
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": args.yarn_factor,
            "original_max_position_embeddings": args.max_position // int(args.yarn_factor),
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    return DeepseekV3Config(
        **common,
        num_key_value_heads=args.heads,
        q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim, moe_intermediate_size=args.moe_intermediate,
        n_routed_experts=args.experts, num_experts_per_tok=args.experts_per_token,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
        rope_parameters=yarn,
    )


def build_model(args: argparse.Namespace, eos_id: int):  # -> a transformers causal LM
    from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM

    if args.arch == "llama":
        return LlamaForCausalLM(model_config(args, eos_id))
    model = DeepseekV3ForCausalLM(model_config(args, eos_id))
    # A Python loop over the experts: at these sizes on the CPU faster than grouped_mm
    # (about 700 against 370 tokens/s, float32, 2 threads).
    model.set_experts_implementation("eager")
    return model


class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing: while training, each MoE layer
    counts the tokens its router sends to each expert, and after every optimizer step its
    `e_score_correction_bias` moves by `rate` toward the under-loaded experts (bias +=
    rate * sign(mean load - load)). The bias changes which experts are chosen, never their
    weights. Nothing for a dense model (no routers)."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        self.loads: dict[torch.nn.Module, torch.Tensor] = {}
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router: torch.nn.Module, args: object, output: tuple) -> None:
        if router.training:
            num_experts = router.get_buffer("e_score_correction_bias").numel()
            counts = torch.bincount(output[2].flatten(), minlength=num_experts)
            self.loads[router] = self.loads.get(router, 0) + counts

    @torch.no_grad()
    def update(self) -> float:
        """Move the biases; returns the step's worst load over the mean (1.0 = balanced)."""
        worst = 1.0
        for router, load in self.loads.items():
            load = load.float()
            router.get_buffer("e_score_correction_bias").add_(
                self.rate * torch.sign(load.mean() - load))
            worst = max(worst, float(load.max() / load.mean()))
        self.loads.clear()
        return worst


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, num_batches: int, batch: int,
             bf16: bool) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(num_batches):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        x = batch_at(data, starts, seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x[:, :-1]).logits
        losses.append(
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        )
    model.train()
    return float(torch.stack(losses).mean())


def train(args: argparse.Namespace) -> None:
    from transformers import GenerationConfig

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
    if args.tokenizer is None:
        tok = train_tokenizer(train_files, args.vocab_size)
        write_tokenizer_files(tok, out, args.max_position)
    else:
        tok = load_tokenizer(Path(args.tokenizer))
        args.vocab_size = tok.get_vocab_size()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(args.tokenizer) / name, out / name)
    train_ids = encode_files(tok, train_files)
    val_ids = encode_files(tok, heldout_files)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, {len(train_ids):,} train tokens, "
          f"{len(val_ids):,} held-out tokens ({time.time() - t0:.0f}s)")

    eos_id = tok.token_to_id(EOS_TOKEN)
    model = build_model(args, eos_id)
    balancer = ExpertBalancer(model, args.bias_update_rate)
    bf16 = args.precision == "bf16"
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
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
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
        if balancer.routers:
            record["expert_load_max_over_mean"] = round(balancer.update(), 3)
        last = step + 1 == total_steps
        if (step + 1) % args.eval_every == 0 or last:
            record["heldout_loss"] = round(evaluate(model, val_ids, args.seq_len, 8, 8, bf16), 4)
        log.write(json.dumps(record) + "\n")
        log.flush()
        if (step + 1) % 10 == 0 or last or "heldout_loss" in record:
            rate = record["tokens"] / max(1e-9, time.time() - t_start)
            extra = f" heldout {record['heldout_loss']:.3f}" if "heldout_loss" in record else ""
            print(f"step {step + 1}/{total_steps} loss {loss.item():.3f}{extra} "
                  f"lr {lr:.2e} {rate:,.0f} tok/s", flush=True)
    log.close()
    model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False,
    ).save_pretrained(out)
    print(f"wrote {out} in {time.time() - t0:.0f}s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="workers/fixture", help="output model directory")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--tokenizer", default=None,
                   help="reuse this model directory's tokenizer (default: train one)")
    p.add_argument("--tokens", type=int, default=None,
                   help="training tokens in all (default: 5M llama, 800k deepseek_v3)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                   help="bf16 autocast or float32 (default: bf16 llama, fp32 deepseek_v3)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=None, help="default: 16 llama, 8 deepseek_v3")
    p.add_argument("--lr", type=float, default=None, help="default: 2e-3 llama, 3e-3 deepseek_v3")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--vocab-size", type=int, default=4096, help="of a trained tokenizer")
    p.add_argument("--hidden", type=int, default=None, help="default: 256 llama, 128 deepseek_v3")
    p.add_argument("--intermediate", type=int, default=None,
                   help="dense MLP width (default: 688 llama, 320 deepseek_v3)")
    p.add_argument("--layers", type=int, default=None, help="default: 12 llama, 4 deepseek_v3")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="llama")
    p.add_argument("--max-position", type=int, default=2048)
    deepseek = p.add_argument_group("deepseek_v3")
    deepseek.add_argument("--q-lora-rank", type=int, default=64)
    deepseek.add_argument("--kv-lora-rank", type=int, default=64)
    deepseek.add_argument("--qk-nope-head-dim", type=int, default=32)
    deepseek.add_argument("--qk-rope-head-dim", type=int, default=16)
    deepseek.add_argument("--v-head-dim", type=int, default=32)
    deepseek.add_argument("--moe-intermediate", type=int, default=96)
    deepseek.add_argument("--experts", type=int, default=8, help="routed experts")
    deepseek.add_argument("--experts-per-token", type=int, default=2)
    deepseek.add_argument("--yarn-factor", type=float, default=4.0)
    # DeepSeek-V3 took 1e-3 over many thousand steps; a few hundred need larger steps.
    deepseek.add_argument("--bias-update-rate", type=float, default=1e-2,
                          help="correction-bias step per optimizer step (ExpertBalancer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    for name, value in ARCH_DEFAULTS[args.arch].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


if __name__ == "__main__":
    train(parse_args(sys.argv[1:]))
