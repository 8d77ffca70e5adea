"""The mask path of structured output against brute force: every node of a chain or a tree
gets the mask of the grammar state its path reaches (a fresh matcher fed the kept tokens and
the path), nodes under a draft the grammar forbids are dead, and the sampler's masking keeps
exactly the allowed tokens. On the fixture's vocabulary, with llguidance."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specd.ipc.sampling import SamplingParams
from specd.ipc.structured import Choice, JsonSchema, Regex, StructuredOutput
from specd.workers.config import FIXTURE_DIR
from specd.workers.engine.batch import ScheduledBatch, ScheduledSequence
from specd.workers.engine.sequence import Sequence
from specd.workers.models.config import ModelConfig
from specd.workers.runner.sampler import apply_token_masks
from specd.workers.spec.step import HostTree
from specd.workers.spec.tree import tree_mask_from_parents
from specd.workers.structured.grammar import GrammarCompiler
from specd.workers.structured.masks import NO_MASKS
from specd.workers.structured.matcher import RequestGrammar
from specd.workers.structured.outputs import StructuredOutput as Structured
from specd.workers.structured.vocabulary import load_vocabulary

CONFIG = ModelConfig.from_dir(FIXTURE_DIR)
VOCAB = CONFIG.vocab_size
WORDS = -(-VOCAB // 32)
SCHEMA = JsonSchema({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"},
    "ok": {"type": "boolean"}}, "required": ["name", "n"], "additionalProperties": False})
CONSTRAINTS = [SCHEMA, Regex(r"(ab|cd)+[0-9]{1,3}"), Choice(["yes", "no", "maybe"])]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(load_vocabulary(FIXTURE_DIR, VOCAB, CONFIG.eos_token_ids))


EOS = frozenset(CONFIG.eos_token_ids)


def eos_only() -> np.ndarray:
    row = np.zeros(WORDS, dtype=np.int64)
    for t in EOS:
        row[t >> 5] |= 1 << (t & 31)
    return np.where(row >= 2**31, row - 2**32, row).astype(np.int32)


def brute_mask(compiler: GrammarCompiler, constraint: StructuredOutput,
               path: list[int]) -> np.ndarray | None:
    """A fresh matcher fed `path` token by token: its mask, or None when the path breaks the
    grammar (the node is dead). An end of sequence is valid where the grammar is complete,
    and after one only another is (llguidance's rule for a stopped matcher)."""
    matcher = compiler.matcher(constraint)
    ended = False
    for token in path:
        if token in EOS and (ended or matcher.is_accepting()):
            ended = True
        elif ended or not matcher.consume_token(token):
            return None
    if ended:
        return eos_only()
    # compute_bitmask may pad its bytes past the words the vocabulary needs.
    return np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)[:WORDS].copy()


def request_grammar(compiler: GrammarCompiler, constraint: StructuredOutput) -> RequestGrammar:
    return RequestGrammar(compiler.matcher(constraint), EOS, WORDS)


def allowed(mask: np.ndarray) -> list[int]:
    return [t for t in range(VOCAB) if (int(mask[t >> 5]) >> (t & 31)) & 1]


def random_tree(compiler: GrammarCompiler, constraint: StructuredOutput, kept: list[int],
                num_nodes: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A tree of `num_nodes` nodes (node 0 the root) whose children are mostly tokens the
    grammar allows at their parent and sometimes ones it forbids (dead subtrees)."""
    tokens, parents = [kept[-1] if kept else 0], [-1]
    paths: list[list[int] | None] = [list(kept)]
    while len(tokens) < num_nodes:
        parent = rng.randrange(len(tokens))
        path = paths[parent]
        mask = None if path is None else brute_mask(compiler, constraint, path)
        options = [] if mask is None else allowed(mask)
        token = rng.choice(options) if options and rng.random() < 0.8 else rng.randrange(VOCAB)
        tokens.append(token)
        parents.append(parent)
        paths.append(None if path is None or mask is None or token not in options
                      else [*path, token])
    return tokens, parents


def check_rows(compiler: GrammarCompiler, constraint: StructuredOutput, kept: list[int],
               tokens: list[int], parents: list[int]) -> None:
    grammar = request_grammar(compiler, constraint)
    assert grammar.advance(kept) is None
    masks = np.full((len(tokens) + 2, WORDS), -1, dtype=np.int32)
    grammar.fill_tree(masks, 1, tokens, parents)
    assert grammar.error is None
    for node in range(len(tokens)):
        path, walk = [], node
        while walk > 0:
            path.append(tokens[walk])
            walk = parents[walk]
        expected = brute_mask(compiler, constraint, kept + path[::-1])
        row = masks[1 + node]
        if expected is None:
            assert (row == -1).all(), f"dead node {node} was written"
        else:
            assert (row == expected).all(), f"node {node}: {allowed(row)[:8]} vs " \
                                            f"{allowed(expected)[:8]}"
    assert (masks[0] == -1).all() and (masks[-1] == -1).all()  # rows outside left alone
    # The matcher is back in the state after the kept tokens.
    after = np.zeros(WORDS, dtype=np.int32)
    grammar.fill_tree(after[None], 0, tokens[:1], [-1])
    assert (after == brute_mask(compiler, constraint, kept)).all()


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=["json_schema", "regex", "choice"])
def test_chain_masks_are_the_states_of_each_prefix(compiler: GrammarCompiler,
                                                   constraint: StructuredOutput) -> None:
    rng = random.Random(1)
    for _ in range(3):
        # A chain that follows the grammar for a while, then breaks it, then goes on.
        tokens: list[int] = [0]
        path: list[int] = []
        for i in range(8):
            mask = brute_mask(compiler, constraint, path)
            options = [] if mask is None else allowed(mask)
            token = rng.choice(options) if options and i != 5 else rng.randrange(VOCAB)
            tokens.append(token)
            path.append(token)
        check_rows(compiler, constraint, [], tokens, list(range(-1, len(tokens) - 1)))


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=["json_schema", "regex", "choice"])
def test_tree_masks_are_the_states_of_each_path(compiler: GrammarCompiler,
                                                constraint: StructuredOutput) -> None:
    rng = random.Random(2)
    for num_nodes in (1, 6, 16, 40):
        kept = random_tree(compiler, constraint, [], 2, rng)[0][1:]  # one kept token
        if brute_mask(compiler, constraint, kept) is None:
            kept = []
        tokens, parents = random_tree(compiler, constraint, kept, num_nodes, rng)
        check_rows(compiler, constraint, kept, tokens, parents)


def test_a_completed_grammar_allows_only_the_end_of_sequence(compiler: GrammarCompiler) -> None:
    grammar = request_grammar(compiler, Choice(["yes"]))
    tokens = compiler.tokenizer.tokenize_str("yes")
    assert grammar.advance(tokens) is None
    masks = np.zeros((3, WORDS), dtype=np.int32)
    eos = CONFIG.eos_token_ids[0]
    # A chain root -> EOS -> EOS: the end of sequence may repeat (ignore_eos).
    grammar.fill_tree(masks, 0, [tokens[-1], eos, eos], [-1, 0, 1])
    assert [allowed(row) for row in masks] == [[eos]] * 3


def test_a_token_the_grammar_refuses_fails_the_grammar(compiler: GrammarCompiler) -> None:
    grammar = request_grammar(compiler, Choice(["yes"]))
    bad = compiler.tokenizer.tokenize_str("no")
    error = grammar.advance(bad)
    assert error is not None and "does not satisfy the grammar" in error
    assert grammar.advance(bad) == error  # failed once, for good


def test_apply_token_masks_keeps_exactly_the_allowed_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(4, vocab, generator=gen)
    bits = torch.rand(2, vocab, generator=gen) < 0.3
    bits[:, 69] = True  # the last token, in the last word's low bits
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r in range(2):
        for t in range(vocab):
            if bits[r, t]:
                words[r, t >> 5] |= 1 << (t & 31)
    masks = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    out = apply_token_masks(logits, torch.tensor([3, 1]), masks)
    for row, r in ((3, 0), (1, 1)):
        expected = torch.where(bits[r], logits[row], float("-inf"))
        assert torch.equal(out[row], expected)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])


def _seq(request_id: str, output: list[int], drafts: list[int],
         structured: StructuredOutput | None) -> Sequence:
    seq = Sequence(request_id, [5, 6, 7], SamplingParams(max_tokens=64, structured=structured))
    seq.output_token_ids = list(output)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.spec_token_ids = list(drafts)
    return seq


def test_a_steps_masks_land_on_their_rows(compiler: GrammarCompiler) -> None:
    structured = Structured(FIXTURE_DIR, VOCAB, CONFIG.eos_token_ids, torch.device("cpu"))
    rng = random.Random(3)
    kept = compiler.tokenizer.tokenize_str('{"name": "ab')
    tokens, parents = random_tree(compiler, SCHEMA, kept, 7, rng)
    plain = _seq("plain", kept, [], SCHEMA)
    tree = _seq("tree", kept, tokens[1:], SCHEMA)
    free = _seq("free", [1, 2], [], None)
    for seq in (plain, tree):
        structured.add(seq.request_id, SCHEMA)
    assert structured.advance([plain, tree, free]) == {}
    host_tree = HostTree(tokens, parents, [0] * len(tokens),
                         tree_mask_from_parents(torch.tensor([parents]))[0].tolist())
    batch = ScheduledBatch([ScheduledSequence(s, 1 + len(s.spec_token_ids), needs_sample=True)
                            for s in (free, tree, plain)])
    for item in batch.scheduled:
        item.seq.pending_sample_ids.append(0)  # the step's own sample
    masks = structured.start_masks(batch, {"tree": host_tree})
    assert masks.layout == {"tree": (0, 7), "plain": (7, 1)}
    logits = torch.zeros(3, VOCAB)
    out = masks.apply(logits, [free, plain, tree])
    root = brute_mask(compiler, SCHEMA, kept)
    assert root is not None
    assert torch.equal(out[0], logits[0])  # unconstrained
    assert (out[1] == 0).nonzero().flatten().tolist() == allowed(root)
    trees = masks.apply_tree(torch.zeros(2, 8, VOCAB), [free, tree])
    assert torch.equal(trees[0], torch.zeros(8, VOCAB)) and torch.equal(trees[1, 7], trees[0, 7])
    grammar = request_grammar(compiler, SCHEMA)
    grammar.advance(kept)
    expected = np.full((7, WORDS), -1, dtype=np.int32)
    grammar.fill_tree(expected, 0, tokens, parents)
    for node in range(7):
        assert (trees[1, node] == 0).nonzero().flatten().tolist() == allowed(expected[node])
    assert structured.figures.num_rows == 8
    structured.close()


def test_no_constrained_row_means_no_masks() -> None:
    structured = Structured(FIXTURE_DIR, VOCAB, CONFIG.eos_token_ids, torch.device("cpu"))
    seq = _seq("free", [1], [], None)
    seq.pending_sample_ids.append(0)
    masks = structured.start_masks(ScheduledBatch([ScheduledSequence(seq, 1)]), {})
    assert masks is NO_MASKS
    logits = torch.zeros(1, VOCAB)
    assert masks.apply(logits, [seq]) is logits
    structured.close()


def test_the_tokens_a_grammar_forces_are_its_drafts(compiler: GrammarCompiler) -> None:
    from specd.workers.spec.worker import _holds_path, chain_host_tree

    structured = Structured(FIXTURE_DIR, VOCAB, CONFIG.eos_token_ids, torch.device("cpu"))
    structured.add("r", Choice(["left or right", "left and right"]))
    forced = structured.forced_drafts("r", 8)
    assert compiler.tokenizer.decode_str(forced) == "left"  # then the choice is open
    assert structured.forced_drafts("r", 1) == forced[:1]
    assert structured.forced_drafts("unconstrained", 8) == []
    chain = chain_host_tree(7, forced)
    assert chain.parents == list(range(-1, len(forced))) and chain.token_ids[1:] == forced
    assert chain.masks == [(1 << (i + 1)) - 1 for i in range(len(forced) + 1)]
    assert _holds_path(chain, forced) and not _holds_path(chain, [forced[0] + 1])
    structured.grammars["r"].ended = True  # past its end only the end of sequence is left
    assert structured.forced_drafts("r", 8) == []
    structured.close()
