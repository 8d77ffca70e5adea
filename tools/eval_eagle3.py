"""Acceptance of an EAGLE-3 head, measured by a dense simulation of greedy speculative decoding.

    python -m tools.eval_eagle3 --target workers/fixture --draft workers/fixture/eagle3

The target runs in transformers (KV cache, tree mask as a 4D attention mask); the head runs
its dense forward over the whole draft sequence each step (`DraftHead.forward_dense`), with
the tree bookkeeping and greedy acceptance of `specd.workers.spec`. Prompts are the
benchmark's held-out prompts (workers/fixture/heldout_prompts.jsonl, never trained on).
For every configuration "steps,topk,draft_tokens" it prints the acceptance length
(emitted tokens per verify pass = accepted drafts + 1), the acceptance rate per draft depth,
and checks that the output equals plain greedy decoding token for token. --json writes
the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specd.workers.spec.accept import accept_greedy
from specd.workers.spec.draft_config import resolve_aux_layer_ids
from specd.workers.spec.draft_model import DraftHead, load_draft_head
from specd.workers.spec.tree import DraftTree, build_tree, expand_tree, start_tree
from tools.train_eagle3 import greedy_continue, load_target
from tools.workload import PROMPTS_FILE, load_prompts


def heldout_prompts(target_dir: Path, num: int) -> list[list[int]]:
    """`num` of the benchmark's held-out prompts (tools/workload.py), evenly spaced over the
    set so that they come from many files, as token ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    rows = load_prompts(len(PROMPTS_FILE.read_text().splitlines()))
    picked = [rows[i * len(rows) // num] for i in range(min(num, len(rows)))]
    return [tok.encode(text).ids for text in picked]


class Simulator:
    """Greedy speculative decoding of one sequence with a transformers target and a head."""

    def __init__(self, target, head: DraftHead, steps: int, topk: int, draft_tokens: int) -> None:
        self.target = target
        self.head = head
        self.steps = steps
        self.topk = topk
        self.draft_tokens = draft_tokens
        self.aux_ids = resolve_aux_layer_ids(head.config, target.config.num_hidden_layers)
        if max(self.aux_ids) >= target.config.num_hidden_layers:
            raise ValueError("eval: aux layer L is after the final norm in transformers' "
                             "hidden_states; this tool cannot capture it")

    def aux(self, out) -> torch.Tensor:
        return torch.cat([out.hidden_states[i][0] for i in self.aux_ids], dim=-1)  # [N, 3H]

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new: int) -> tuple[list[int], list[int]]:
        """(new tokens, accepted drafts per verify pass)."""
        out = self.target(input_ids=torch.tensor([prompt]), use_cache=True,
                          output_hidden_states=True)
        cache, feats = out.cache, self.aux(out)  # feats[r]: target hidden at position r
        tokens = list(prompt) + [int(out.logits[0, -1].argmax())]
        cached = len(prompt)
        accepted_per_pass = []
        while len(tokens) - len(prompt) < max_new:
            tree = self.draft(tokens, feats)
            out, first = self.verify(tokens, cached, tree, cache)
            acc = accept_greedy(tree, out.logits[0, first:].argmax(-1)[None])
            nodes = acc.node_lists()[0]
            feats = torch.cat([feats, self.aux(out)[[first] + [first + n for n in nodes]]])
            cached = len(tokens)
            # Drop the tree's KV (a negative crop removes that many); accepted tokens are
            # re-fed causally at the next pass.
            cache.crop(cached - cache.get_seq_length())
            tokens += acc.token_lists()[0]
            accepted_per_pass.append(len(nodes))
        return tokens[len(prompt): len(prompt) + max_new], accepted_per_pass

    def verify(self, tokens: list[int], cached: int, tree: DraftTree, cache):
        """Target pass over the uncached committed tokens (causal) then the tree (tree mask)."""
        pending = tokens[cached:-1]  # accepted last pass, KV not kept; the root is tokens[-1]
        num_pending, num_nodes = len(pending), tree.num_nodes
        ids = torch.tensor([pending + tree.token_ids[0].tolist()])
        root_pos = len(tokens) - 1
        positions = torch.cat([torch.arange(cached, root_pos), root_pos + tree.depths[0]])
        rows = num_pending + num_nodes
        allowed = torch.zeros(rows, cached + rows, dtype=torch.bool)
        allowed[:, :cached] = True
        allowed[:, cached: cached + num_pending] = torch.ones(
            rows, num_pending, dtype=torch.bool).tril()
        allowed[num_pending:, cached:cached + num_pending] = True
        bits = (tree.tree_mask[0][:, None] >> torch.arange(num_nodes)) & 1  # [T, T]
        allowed[num_pending:, cached + num_pending:] = bits.bool()
        mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
        out = self.target(input_ids=ids, cache=cache, attention_mask=mask,
                          position_ids=positions[None], use_cache=True, output_hidden_states=True)
        return out, num_pending

    def draft(self, tokens: list[int], feats: torch.Tensor) -> DraftTree:
        """The head's tree for the next pass. Draft row r reads token r + 1 and the target's
        hidden state at r (or its own output for drafted rows), at rope position r."""
        head, m = self.head, len(tokens) - 1
        embeds = head.embed_tokens(torch.tensor(tokens[1:]))  # [m, H]
        hidden = head.fuse(feats[:m])
        positions = torch.arange(m)
        out = head.forward_dense(embeds[None], hidden[None], positions[None])[0]
        cands, frontier = start_tree(*self.top(out[-1:]))
        frontier_hidden = out[-1:].expand(self.topk, -1)
        rows_e, rows_h, rows_p, rows_m = [], [], [], []
        for _ in range(self.steps - 1):
            rows_e.append(head.embed_tokens(frontier.token_ids[0]))
            rows_h.append(frontier_hidden)
            rows_p.append(torch.full((self.topk,), m - 1 + frontier.depth))
            rows_m.append(frontier.scratch_masks[0])
            num_scratch = self.topk * len(rows_e)
            bits = (torch.cat(rows_m)[:, None] >> torch.arange(num_scratch)) & 1
            mask = torch.ones(m + num_scratch, m + num_scratch, dtype=torch.bool).tril()
            mask[m:, m:] = bits.bool()
            seq_e = torch.cat([embeds, *rows_e])[None]
            seq_h = torch.cat([hidden, *rows_h])[None]
            seq_p = torch.cat([positions, *rows_p])[None]
            new = head.forward_dense(seq_e, seq_h, seq_p, mask)[0, -self.topk:]  # [K, H]
            lp, ids = self.top(new)
            cands, frontier = expand_tree(cands, frontier, lp[None], ids[None])
            frontier_hidden = new[frontier.parent_slots[0]]
        return build_tree(cands, torch.tensor([tokens[-1]]), self.draft_tokens)

    def top(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K log-probabilities and target ids of each row of head outputs [R, H]: [R, K]."""
        logprobs = torch.log_softmax(self.head.logits(out).float(), dim=-1)
        values, draft_ids = logprobs.topk(self.topk, dim=-1)
        return values, self.head.to_target_ids(draft_ids)


def evaluate(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    target_dir = Path(args.target)
    target = load_target(target_dir, "cpu")
    head = load_draft_head(args.draft, target.get_input_embeddings().weight.detach())
    prompts = heldout_prompts(target_dir, args.num_prompts)
    plain = [greedy_continue(target, torch.tensor([p]), args.max_new)[0, len(p):].tolist()
             for p in prompts]
    results = {}
    for spec in args.configs:
        steps, topk, draft_tokens = (int(x) for x in spec.split(","))
        sim = Simulator(target, head, steps, topk, draft_tokens)
        t0 = time.time()
        accepted: list[int] = []
        lossless = True
        for prompt, reference in zip(prompts, plain, strict=True):
            new, per_pass = sim.generate(prompt, args.max_new)
            lossless &= new == reference
            accepted += per_pass
        depth_rate = [sum(a >= d for a in accepted) / len(accepted) for d in range(1, steps + 1)]
        results[spec] = {
            "steps": steps, "topk": topk, "draft_tokens": draft_tokens,
            "acceptance_length": sum(accepted) / len(accepted) + 1,
            "acceptance_rate_by_depth": [round(r, 3) for r in depth_rate],
            "verify_passes": len(accepted), "lossless": lossless,
            "seconds": round(time.time() - t0, 1)}
        r = results[spec]
        print(f"steps {steps} topk {topk} draft tokens {draft_tokens}: acceptance length "
              f"{r['acceptance_length']:.3f} over {r['verify_passes']} passes; by depth "
              f"{' '.join(f'{x:.2f}' for x in depth_rate)}; equals plain greedy: {lossless} "
              f"({r['seconds']}s)", flush=True)
    return {"prompts": len(prompts), "max_new": args.max_new, "results": results}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="workers/fixture")
    p.add_argument("--draft", default="workers/fixture/eagle3")
    p.add_argument("--configs", nargs="+", default=["3,1,4", "5,1,6", "5,4,8", "5,4,16"],
                   help="steps,topk,draft_tokens (draft tokens count the root)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the figures here")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    figures = evaluate(args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
