"""Train an EAGLE-3 draft head for a Hugging Face target (Llama-style, or DeepSeek-V3: the
head is a Llama layer either way), on the CPU or a GPU.

    python -m tools.train_eagle3 --target workers/fixture --out workers/fixture/eagle3 --minutes 20

    nice -n 10 python -m tools.train_eagle3 --target ~/.cache/specd/models/SmolLM2-135M-Instruct \
        --data file --sequences /tmp/smollm2_answers.jsonl --out workers/heads/NAME ...

Data. By default (`--data greedy`) the target continues prompts greedily: the head then
learns the token stream it will see when serving greedy requests. Half the prompts end at a
`def` line (as the benchmark's held-out prompts do, but from training files), half are random
windows of the training text. `--data text` trains on the text itself. The default corpus
is the fixture's training files (the stdlib source, held-out files excluded;
`train_fixture.corpus_files`). `--data file` reads prompts and the target's own answers
from `--sequences` (JSON lines with prompt_ids and answer_ids, as tools/chat_answers.py
writes them) and trains on the answer tokens only: a chat model's head learns the answers
it will draft, not the prompts (which the target prefills).

Draft vocabulary: the `--draft-vocab-size` most frequent tokens of the training sequences
(of the answers, with `--data file`; `d2t`/`t2d`). Target hidden states come from
transformers' `output_hidden_states` at the head's aux layer ids (default (2, L // 2, L - 3);
0 = embedding output, k = output of block k-1). The loss is EAGLE-3's: cross-entropy against
the target's distribution restricted to the draft vocabulary, over `--ttt-steps` unrolled
draft steps (training-time test): step k feeds the head its own step k-1 output and the next
token, and each row attends to the step-0 rows before it plus its own rows of steps 1..k, as
a drafted token attends to the verified prefix and its draft ancestors. Step k is weighted
0.8^k. Rows whose target argmax lies outside the draft vocabulary are not trained on.

Memory. Training keeps the target's logits over the draft vocabulary only (and its argmax
over the whole vocabulary). With `--data file` the full logits never outlive one batch of
the target's forward (at a vocabulary of 49,152 they are 98 KB a position in bf16); with
`--data greedy` (the fixtures, a few thousand tokens of vocabulary) they are kept until the
draft vocabulary is known, as the generation makes them. The sequences are kept flat,
without padding; a training batch pads its sequences to the longest of them.

Writes config.json (`LlamaForCausalLMEagle3`, `draft_vocab_size`, `eagle_config` whose ids
follow that format's rule, id i = the output of block i: one less than the numbering above),
model.safetensors (`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`;
the embedding is the target's) and train_log.jsonl.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from specd.workers.spec.draft_config import DraftConfig, aux_layer_ids_as, resolve_aux_layer_ids
from specd.workers.spec.draft_model import DraftHead
from tools.eagle3_data import (
    TrainData,
    file_data,
    from_dense,
    load_features,
    read_sequences,
    save_features,
)
from tools.make_prompts import prompts_from_file
from tools.train_fixture import corpus_files, read_text, stdlib_root

LOSS_DECAY = 0.8  # weight of unrolled step k is LOSS_DECAY ** k, as in EAGLE-3


def load_target(path: Path, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.nn.Module.to(model, device)  # in place (transformers' own `to` confuses mypy)
    return model.eval()


def head_config(target_cfg, draft_vocab_size: int, aux_ids: tuple[int, ...],
                intermediate_size: int | None = None) -> DraftConfig:
    """The head's shape from the target's (a Llama layer of the target's width; its MLP as
    wide as the target's unless `intermediate_size` is given). An MLA target's `head_dim`
    names its rope part (DeepseekV3Config): the head's attention then takes hidden // heads,
    as for a target without head_dim."""
    heads = target_cfg.num_attention_heads
    rope = getattr(target_cfg, "rope_parameters", None) or {}
    is_mla = getattr(target_cfg, "kv_lora_rank", None) is not None
    head_dim = None if is_mla else getattr(target_cfg, "head_dim", None)
    return DraftConfig(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=target_cfg.num_key_value_heads or heads,
        head_dim=head_dim or target_cfg.hidden_size // heads,
        vocab_size=target_cfg.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target_cfg.hidden_size,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(target_cfg, "rope_theta", 10000.0)),
        max_position_embeddings=target_cfg.max_position_embeddings,
        aux_layer_ids=aux_ids,
    )


def config_json(cfg: DraftConfig) -> dict:
    """config.json in the published EAGLE-3 layout (SpecForge/SGLang/vLLM read it)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        # The format's own numbering: id i = the output of block i (`hidden_states[i + 1]`).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                         aux_layer_ids_as(cfg, "LlamaForCausalLMEagle3") or []},
    }


# --- data ---


def corpus_ids(tokenizer_path: Path, max_files: int, rng: random.Random) -> torch.Tensor:
    """Token ids of (a random subset of) the training files, concatenated: int64 [n]."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    files, _ = corpus_files(stdlib_root())
    files = rng.sample(files, min(max_files, len(files)))
    ids: list[int] = []
    for enc in tok.encode_batch([read_text(p) for p in files]):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def def_prompts(tokenizer_path: Path, length: int, rng: random.Random) -> torch.Tensor:
    """[n, length]: the last `length` tokens of windows ending at a `def` line, from the
    training files, in the style of the held-out benchmark prompts (tools/make_prompts.py)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    files, _ = corpus_files(stdlib_root())
    texts = [t for p in files for t in prompts_from_file(read_text(p), 24, 8)]
    rows = [enc.ids[-length:] for enc in tok.encode_batch(texts) if len(enc.ids) >= length]
    rng.shuffle(rows)
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def greedy_continue(target, prompts: torch.Tensor, num_new: int) -> torch.Tensor:
    """prompts [B, P] -> [B, P + num_new]: the target's greedy continuation (EOS not special)."""
    return greedy_continue_with_outputs(target, prompts, num_new, ())[0]


@torch.no_grad()
def greedy_continue_with_outputs(target, prompts: torch.Tensor, num_new: int,
                                 aux_ids: tuple[int, ...],
                                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Greedy continuation plus the target's outputs at every position, from the same passes.

    Returns tokens [B, P + num_new], aux hidden states [B, P + num_new, 3H] (None when no
    aux_ids) and logits [B, P + num_new, V], in the target's dtype.
    """
    want_hidden = bool(aux_ids)
    out = target(input_ids=prompts, use_cache=True, output_hidden_states=want_hidden)
    tokens, logits, aux = [prompts], [out.logits], []
    if want_hidden:
        aux.append(torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1))
    for _ in range(num_new):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        out = target(input_ids=nxt, cache=out.cache, use_cache=True,
                     output_hidden_states=want_hidden)
        logits.append(out.logits)
        if want_hidden:
            aux.append(torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1))
    return (torch.cat(tokens, dim=1), torch.cat(aux, dim=1) if aux else None,
            torch.cat(logits, dim=1))


def build_data(args: argparse.Namespace, target, stream: torch.Tensor, aux_ids: tuple[int, ...],
               gen: torch.Generator,
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Text windows, or prompts + the target's greedy continuations with its outputs:
    tokens [N, S], aux hidden states [N, S, 3H] and full logits [N, S, V] (bf16; both None
    for text)."""
    if args.data == "text":
        starts = torch.randint(0, len(stream) - args.seq_len, (args.num_sequences,), generator=gen)
        return torch.stack([stream[s: s + args.seq_len] for s in starts.tolist()]), None, None
    prompt_len = args.prompt_tokens
    # Half the prompts end at a def line (as the benchmark's), half are random text windows.
    num_def = args.num_sequences // 2
    defs = def_prompts(Path(args.target) / "tokenizer.json", prompt_len,
                       random.Random(args.seed))[:num_def]
    num_random = args.num_sequences - len(defs)
    starts = torch.randint(0, len(stream) - prompt_len, (num_random,), generator=gen)
    windows = torch.stack([stream[s: s + prompt_len] for s in starts.tolist()])
    prompts = torch.cat([defs, windows])[torch.randperm(args.num_sequences, generator=gen)]
    tokens, aux, logits, t0 = [], [], [], time.time()
    for i in range(0, len(prompts), args.gen_batch):
        with autocast(args):
            t, a, lg = greedy_continue_with_outputs(
                target, prompts[i: i + args.gen_batch].to(args.device),
                args.seq_len - prompt_len, aux_ids)
        if a is None:
            raise RuntimeError("greedy data: no aux hidden states were captured")
        tokens.append(t.cpu())
        aux.append(a.to(torch.bfloat16).cpu())
        logits.append(lg.to(torch.bfloat16).cpu())
        done = min(i + args.gen_batch, len(prompts))
        print(f"generated {done}/{len(prompts)} continuations ({time.time() - t0:.0f}s)",
              flush=True)
    return torch.cat(tokens), torch.cat(aux), torch.cat(logits)


def draft_vocab(sequences: torch.Tensor, vocab_size: int, size: int,
                ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(d2t int64 [size], t2d bool [vocab], coverage): the most frequent tokens of
    `sequences` (any shape), by id order."""
    counts = torch.bincount(sequences.flatten(), minlength=vocab_size)
    kept = counts.topk(size).indices.sort().values  # target ids, ascending
    d2t = kept - torch.arange(size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d, float(counts[kept].sum() / counts.sum())


# --- training-time test ---


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  scale: float) -> torch.Tensor:
    """Attention of unrolled step k = len(keys) - 1.

    q [B, T, heads, d]; keys/values: one [B, T, kv_heads, d] per step 0..k. Row i sees the
    step-0 rows 0..i (causal) and row i of each step 1..k (its draft ancestors and itself).
    """
    group = q.shape[2] // keys[0].shape[2]
    ks = [k.repeat_interleave(group, dim=2) for k in keys]
    vs = [v.repeat_interleave(group, dim=2) for v in values]
    num_rows = q.shape[1]
    prefix = torch.einsum("bihd,bjhd->bhij", q, ks[0]) * scale  # [B, heads, T, T]
    causal = torch.ones(num_rows, num_rows, dtype=torch.bool, device=q.device).tril()
    prefix = prefix.masked_fill(~causal, float("-inf"))
    diag = [torch.einsum("bihd,bihd->bhi", q, k)[..., None] * scale for k in ks[1:]]
    weights = torch.softmax(torch.cat([prefix, *diag], dim=-1), dim=-1)  # [B, heads, T, T + k]
    out = torch.einsum("bhij,bjhd->bihd", weights[..., :num_rows], vs[0])
    for j, v in enumerate(vs[1:]):
        out = out + weights[..., num_rows + j].transpose(1, 2)[..., None] * v
    return out  # [B, T, heads, d]


def ttt_loss(head: DraftHead, aux: torch.Tensor, draft_logits: torch.Tensor,
             target_top: torch.Tensor, seqs: torch.Tensor, loss_mask: torch.Tensor,
             num_steps: int) -> tuple[torch.Tensor, list[float]]:
    """Weighted loss over the unrolled steps, and the top-1 agreement with the target per step.

    seqs [B, S]; aux [B, S, 3H] the target's hidden states at the aux layers; draft_logits
    [B, S, Vd] its logits over the draft vocabulary, target_top [B, S] its argmax over the
    whole vocabulary; loss_mask [B, S] the positions trained on. Row i of step k reads token
    i + 1 + k and predicts token i + 2 + k (the target's distribution at position i + 1 + k),
    at rope position i + k.
    """
    target_p = torch.softmax(draft_logits.float(), dim=-1)  # [B, S, Vd]
    in_vocab = head.t2d[target_top] & loss_mask  # [B, S]: trained, and the draft can name it
    num_rows = seqs.shape[1] - 1
    rows = torch.arange(num_rows, device=seqs.device)
    hidden = head.fuse(aux[:, :num_rows].to(head.fc.weight.dtype))
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = torch.zeros((), device=seqs.device)
    agreement = []
    for k in range(num_steps):
        src = (rows + 1 + k).clamp(max=seqs.shape[1] - 1)  # token read by row i at step k
        valid = (rows + 1 + k) < seqs.shape[1]  # [T]
        embeds = head.embed_tokens(seqs[:, src])
        positions = (rows + k).expand(seqs.shape[0], -1)
        q, key, value = head.qkv(embeds, hidden, positions)
        keys.append(key)
        values.append(value)
        out = head.finish(ttt_attention(q, keys, values, head.scale), hidden)
        log_q = torch.log_softmax(head.logits(out).float(), dim=-1)  # [B, T, Vd]
        mask = (valid[None] & in_vocab[:, src]).float()  # [B, T]
        ce = -(target_p[:, src] * log_q).sum(-1)
        total = total + LOSS_DECAY ** k * (ce * mask).sum() / mask.sum().clamp(min=1)
        hit = (head.to_target_ids(log_q.argmax(-1)) == target_top[:, src]).float()
        counted = (valid[None] & loss_mask[:, src]).float()
        agreement.append(float((hit * counted).sum() / counted.sum().clamp(min=1)))
        hidden = out
    return total, agreement


def autocast(args: argparse.Namespace) -> torch.autocast:
    """bf16 autocast (3x the fp32 matmul rate on this CPU); master weights stay fp32."""
    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=not args.fp32)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(0.1, 1.0 - 0.9 * (step - warmup) / max(1, total - warmup))


def prepare_data(args: argparse.Namespace, target, aux_ids: tuple[int, ...], rng: random.Random,
                 gen: torch.Generator) -> tuple[TrainData, torch.Tensor, torch.Tensor, float]:
    """(data, d2t, t2d, coverage): the training sequences with the target's outputs over
    them, and the draft vocabulary chosen from them."""
    vocab_size = target.config.vocab_size
    size = min(args.draft_vocab_size, vocab_size)
    if args.data == "file":
        seqs, prompt_lens = read_sequences(Path(args.sequences), args.seq_len)
        answers = torch.tensor([t for s, n in zip(seqs, prompt_lens, strict=True) for t in s[n:]])
        d2t, t2d, coverage = draft_vocab(answers, vocab_size, size)
        draft_ids = d2t + torch.arange(len(d2t))
        cache = Path(args.features_cache) if args.features_cache else None
        if cache is not None and cache.is_file():
            data = load_features(cache, seqs, d2t)
            print(f"target outputs read from {cache}")
        else:
            with autocast(args):
                data = file_data(target, seqs, prompt_lens, aux_ids, draft_ids,
                                 args.batch_tokens, args.device)
            if cache is not None:
                save_features(cache, data, d2t)
        print(f"data: {len(seqs)} sequences, {len(data.tokens):,} tokens, {len(answers):,} "
              f"answer tokens trained on")
        return data, d2t, t2d, coverage
    stream = corpus_ids(Path(args.target) / "tokenizer.json", args.max_files, rng)
    print(f"corpus: {len(stream):,} tokens")
    tokens, aux, logits = build_data(args, target, stream, aux_ids, gen)
    d2t, t2d, coverage = draft_vocab(tokens, vocab_size, size)
    print(f"data: {tokens.shape[0]} sequences x {tokens.shape[1]} tokens")
    return from_dense(tokens, aux, logits, d2t + torch.arange(len(d2t))), d2t, t2d, coverage


def target_pass(target, batch: dict[str, torch.Tensor], aux_ids: tuple[int, ...],
                draft_ids: torch.Tensor, args: argparse.Namespace,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(aux, draft_logits, target_top) of a batch: kept from the data, or (`--data text`)
    computed now by the target."""
    if "aux" in batch:
        return batch["aux"], batch["draft_logits"], batch["target_top"]
    with torch.no_grad(), autocast(args):
        out = target(input_ids=batch["tokens"], output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1)
    return aux, out.logits[..., draft_ids], out.logits.argmax(-1)


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    target_dir, out = Path(args.target), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    deadline = t_start + args.minutes * 60

    target = load_target(target_dir, args.device)
    if not args.fp32:
        target.to(torch.bfloat16)  # cast once; autocast would re-cast every decode step
    for p in target.parameters():
        p.requires_grad_(False)
    tcfg = target.config
    num_layers = tcfg.num_hidden_layers
    aux_ids = tuple(args.aux_layers) if args.aux_layers else (2, num_layers // 2, num_layers - 3)
    if any(not 0 <= i < num_layers for i in aux_ids):
        # transformers' hidden_states[L] is after the final norm, not the block output.
        raise ValueError(f"--aux-layers {list(aux_ids)}: must lie in [0, {num_layers - 1}]")
    print(f"target {num_layers} layers, aux layers {aux_ids}")
    data, d2t, t2d, coverage = prepare_data(args, target, aux_ids, rng, gen)
    print(f"draft vocab {len(d2t)} covers {coverage:.1%} of the tokens trained on "
          f"({time.time() - t_start:.0f}s)")

    cfg = head_config(tcfg, len(d2t), aux_ids, args.head_intermediate_size)
    resolve_aux_layer_ids(cfg, num_layers)  # validates the ids against the target
    head = DraftHead(cfg, torch.device(args.device)).to(args.device)
    head.embed_tokens.weight = target.get_input_embeddings().weight  # shared, frozen
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    draft_ids = (d2t + torch.arange(len(d2t))).to(args.device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    log = (out / "train_log.jsonl").open("w")
    log.write(json.dumps({"args": vars(args), "aux_layer_ids": aux_ids,
                          "draft_vocab_coverage": round(coverage, 4)}) + "\n")
    est_steps = args.max_steps
    step, t_train = 0, time.time()
    while step < args.max_steps and time.time() < deadline:
        idx = torch.randint(0, data.num_sequences, (args.batch,), generator=gen)
        batch = {k: v.to(args.device) for k, v in data.batch(idx).items()}
        aux, draft_logits, target_top = target_pass(target, batch, aux_ids, draft_ids, args)
        # The schedule decays over the steps the time box allows, estimated from the pace.
        if step == 5:
            per_step = (time.time() - t_train) / 5
            est_steps = min(args.max_steps, step + int((deadline - time.time()) / per_step))
        lr = lr_at(step, est_steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast(args):
            loss, agreement = ttt_loss(head, aux, draft_logits, target_top, batch["tokens"],
                                       batch["loss_mask"], args.ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        record = {"step": step, "loss": round(loss.item(), 4), "lr": round(lr, 6),
                  "agreement": [round(a, 3) for a in agreement],
                  "elapsed_s": round(time.time() - t_start, 1)}
        log.write(json.dumps(record) + "\n")
        log.flush()
        if step % 10 == 0 or step == 1:
            print(f"step {step}/~{est_steps} loss {loss.item():.3f} top-1 agreement by step "
                  f"{' '.join(f'{a:.2f}' for a in agreement)} ({record['elapsed_s']:.0f}s)",
                  flush=True)
    log.close()
    save_head(head, cfg, out)
    print(f"wrote {out} after {step} steps in {time.time() - t_start:.0f}s")


def save_head(head: DraftHead, cfg: DraftConfig, out: Path) -> None:
    """model.safetensors (bf16 weights, int64 d2t, bool t2d; no embedding) + config.json."""
    tensors = {n: p.detach().to(torch.bfloat16).contiguous().cpu()
               for n, p in head.named_parameters() if n != "embed_tokens.weight"}
    tensors["d2t"] = head.d2t.cpu().contiguous()
    tensors["t2d"] = head.t2d.cpu().contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config_json(cfg), indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="workers/fixture", help="target model directory")
    p.add_argument("--out", default="workers/fixture/eagle3", help="output head directory")
    p.add_argument("--data", choices=("greedy", "text", "file"), default="greedy")
    p.add_argument("--sequences", default=None,
                   help="--data file: JSON lines with prompt_ids and answer_ids")
    p.add_argument("--batch-tokens", type=int, default=4096,
                   help="--data file: tokens per forward of the target over the data")
    p.add_argument("--features-cache", default=None,
                   help="--data file: the target's outputs, read if the file exists, else "
                        "computed and written there (a rerun on the same data skips them)")
    p.add_argument("--head-intermediate-size", type=int, default=None,
                   help="the head's MLP width (default: the target's)")
    p.add_argument("--minutes", type=float, default=20.0, help="time box for everything")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--max-files", type=int, default=400, help="training files to draw text from")
    p.add_argument("--num-sequences", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=32, help="greedy data: prompt length")
    p.add_argument("--gen-batch", type=int, default=64, help="greedy data: generation batch")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ttt-steps", type=int, default=5, help="unrolled draft steps")
    p.add_argument("--draft-vocab-size", type=int, default=2048)
    p.add_argument("--aux-layers", type=int, nargs=3, default=None,
                   help="output_hidden_states ids (default 2, L//2, L-3)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.data == "file") != (args.sequences is not None):
        p.error("--sequences goes with --data file, and --data file needs it")
    return args


if __name__ == "__main__":
    train(parse_args(sys.argv[1:]))
