"""Chat questions built offline, for training and measuring a chat model's EAGLE-3 head.

    python -m tools.chat_prompts --split train --out /tmp/chat_train.jsonl
    python -m tools.chat_prompts --split heldout --out /tmp/chat_heldout.jsonl

Nothing is downloaded: every question is a template filled from lists written here or from
this interpreter's standard library (module and function names, and the first line of
their docstrings), in four families:

* `stdlib`: what a standard-library module or function does, how to use it, with its
  docstring's first line quoted (a curated list of modules that import without side
  effects; the docstrings are this Python's, so the set follows the Python version);
* `arithmetic`: sums, products, differences, quotients, percentages, square roots,
  primality and word problems over seeded random numbers;
* `knowledge`: capitals, languages, history, science and everyday concepts explained,
  word meanings, poems, haiku, stories and advice;
* `coding`: functions to write (Python, JavaScript, C, a shell one-liner), concepts to
  compare, code to explain.

Deterministic for a given Python version and seed. Each question lands in one split by a
stable hash of its text (one in `HELDOUT_EVERY` is held out), so the held-out questions
never appear in training, whatever subset or order a tool takes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import random
import warnings
from collections.abc import Iterator
from pathlib import Path

HELDOUT_EVERY = 25

STDLIB_MODULES = (
    "os", "os.path", "sys", "json", "re", "math", "cmath", "random", "itertools", "functools",
    "collections", "datetime", "time", "string", "textwrap", "pathlib", "shutil", "statistics",
    "heapq", "bisect", "copy", "csv", "hashlib", "base64", "struct", "operator", "typing",
    "dataclasses", "enum", "argparse", "logging", "urllib.parse", "threading", "queue", "glob",
    "fnmatch", "tempfile", "zipfile", "gzip", "pickle", "io", "contextlib", "decimal",
    "fractions", "uuid", "secrets", "difflib", "pprint", "calendar", "html", "sqlite3",
    "asyncio", "inspect", "traceback", "weakref", "array", "zlib", "shlex", "platform",
    "unicodedata", "binascii", "codecs", "locale", "abc", "numbers", "ipaddress", "email.utils",
    "http.client", "socket", "selectors", "subprocess", "configparser", "tarfile", "bz2",
    "lzma", "hmac", "getopt", "keyword", "token", "ast", "dis", "timeit", "cProfile", "pdb",
    "doctest", "unittest", "xml.etree.ElementTree", "html.parser", "mimetypes", "quopri",
    "colorsys", "wave", "graphlib", "zoneinfo", "tomllib", "sched", "contextvars",
)

COUNTRIES = (
    "France", "Germany", "Italy", "Spain", "Portugal", "Japan", "China", "India", "Brazil",
    "Argentina", "Canada", "Mexico", "Egypt", "Kenya", "Nigeria", "Australia", "Norway",
    "Sweden", "Finland", "Poland", "Greece", "Turkey", "Russia", "Peru", "Chile", "Colombia",
    "Vietnam", "Thailand", "Indonesia", "South Korea", "Ireland", "Scotland", "Austria",
    "Switzerland", "the Netherlands", "Belgium", "Denmark", "Iceland", "Morocco", "Ethiopia",
    "Ghana", "New Zealand", "Cuba", "Jamaica", "Pakistan", "Iran", "Saudi Arabia", "Israel",
    "Ukraine", "Hungary", "Czechia", "Romania", "Bulgaria", "Croatia", "Philippines",
    "Malaysia", "Singapore", "Nepal", "Mongolia", "Venezuela",
)

CONCEPTS = (
    "photosynthesis", "gravity", "the water cycle", "black holes", "DNA", "evolution",
    "climate change", "inflation", "supply and demand", "democracy", "the immune system",
    "electricity", "magnetism", "the speed of light", "plate tectonics", "volcanoes",
    "earthquakes", "the solar system", "the moon's phases", "tides", "rainbows", "vaccines",
    "antibiotics", "the human heart", "the brain", "sleep", "nutrition", "exercise",
    "machine learning", "neural networks", "the internet", "encryption", "blockchain",
    "compound interest", "taxes", "the stock market", "renewable energy", "nuclear power",
    "recycling", "biodiversity", "the Renaissance", "the Industrial Revolution",
    "the Roman Empire", "ancient Egypt", "the printing press", "the French Revolution",
    "World War I", "the Cold War", "the Olympic Games", "jazz music", "impressionism",
    "the scientific method", "atoms", "chemical reactions", "acids and bases", "friction",
    "momentum", "sound waves", "the greenhouse effect", "ocean currents", "bees", "coral reefs",
    "rain forests", "deserts", "glaciers", "hurricanes", "operating systems", "databases",
    "cloud computing", "recursion", "algorithms", "binary numbers", "prime numbers",
    "probability", "statistics", "geometry", "fractions", "the Pythagorean theorem",
    "meditation", "time management", "public speaking", "critical thinking",
)

THINGS = (
    "the sea", "autumn", "a cat", "the city at night", "mountains", "rain", "friendship",
    "the stars", "a garden", "coffee", "winter", "a river", "the wind", "an old library",
    "a train journey", "the desert", "a lighthouse", "snow", "the forest", "a robot",
    "the first day of school", "a lost key", "a dragon", "the moon", "summer", "bread",
    "a thunderstorm", "a bicycle", "the ocean floor", "a small village",
)

ACTIVITIES = (
    "learning a new language", "staying focused while studying", "cooking rice",
    "saving money", "running a marathon", "sleeping better", "writing an essay",
    "starting a vegetable garden", "keeping a houseplant alive", "preparing for a job interview",
    "learning to program", "reducing stress", "traveling on a budget", "taking better photos",
    "making friends in a new city", "reading more books", "drinking more water",
    "organizing a closet", "learning to swim", "giving a presentation", "writing clean code",
    "debugging a program", "working from home", "eating healthier", "learning the guitar",
)

WORDS = (
    "ephemeral", "ubiquitous", "serendipity", "resilient", "meticulous", "candid",
    "benevolent", "pragmatic", "ambiguous", "eloquent", "frugal", "gregarious", "nostalgia",
    "paradox", "verbose", "tenacious", "whimsical", "zealous", "altruism", "cacophony",
    "diligent", "empathy", "hypothesis", "irony", "lucid", "metaphor", "obsolete", "quaint",
    "redundant", "skeptical",
)

CODING_TASKS = (
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a string",
    "finds the largest element of a list", "removes duplicates from a list",
    "checks whether a string is a palindrome", "sorts a list of numbers with bubble sort",
    "merges two sorted lists", "computes the greatest common divisor of two numbers",
    "converts Celsius to Fahrenheit", "counts the words in a sentence",
    "flattens a nested list", "checks whether two strings are anagrams",
    "returns the sum of the digits of a number", "finds the second largest number in a list",
    "capitalizes the first letter of every word", "computes the average of a list",
    "reads a text file and counts its lines", "converts a decimal number to binary",
    "implements binary search", "transposes a matrix", "checks whether a year is a leap year",
    "generates all permutations of a string", "finds the intersection of two lists",
    "counts how often each character appears in a string", "reverses a linked list",
    "implements a stack with push and pop", "validates an email address",
    "returns the prime numbers below n", "computes the power set of a set",
    "rotates a list by k positions", "finds the longest word in a sentence",
    "checks whether parentheses are balanced", "computes the median of a list",
    "converts a Roman numeral to an integer", "removes whitespace from a string",
    "finds the missing number in a list from 1 to n", "implements quicksort",
    "multiplies two matrices", "computes the area of a circle", "swaps two variables",
    "returns the n largest items of a list", "groups words by their first letter",
    "parses a CSV line into fields", "checks whether a list is sorted",
    "computes the running total of a list", "finds all divisors of a number",
    "converts a string to title case",
)

LANGUAGES = ("Python", "Python", "Python", "JavaScript", "C", "Java", "Rust", "Go")

COMPARISONS = (
    ("a list", "a tuple"), ("a list", "a set"), ("a dictionary", "a list"),
    ("a class", "an object"), ("a function", "a method"), ("a compiler", "an interpreter"),
    ("== ", "is"), ("a process", "a thread"), ("TCP", "UDP"), ("HTTP", "HTTPS"),
    ("a stack", "a queue"), ("an array", "a linked list"), ("SQL", "NoSQL databases"),
    ("recursion", "iteration"), ("git merge", "git rebase"), ("RAM", "a hard disk"),
    ("a shallow copy", "a deep copy"), ("static typing", "dynamic typing"),
    ("synchronous", "asynchronous code"), ("a library", "a framework"),
)

PROGRAMMING_TOPICS = (
    "a for loop", "a while loop", "an if statement", "a list comprehension", "a decorator",
    "a generator", "a lambda function", "exception handling", "a context manager",
    "object-oriented programming", "inheritance", "a hash table", "a binary tree",
    "big O notation", "a regular expression", "unit testing", "version control",
    "an API", "JSON", "a variable", "a pointer", "garbage collection", "a closure",
    "type hints", "a virtual environment",
)


def stdlib_questions() -> Iterator[tuple[str, str]]:
    """(family, question) about standard-library modules and their public callables."""
    templates = (
        "What does `{name}` do in Python?",
        "How do I use `{name}` in Python? Show a short example.",
        "Explain the Python function `{name}`. Its documentation begins: \"{doc}\"",
    )
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        yield "stdlib", f"What is the `{module_name}` module in Python's standard library used for?"
        yield "stdlib", f"Give an example of using Python's `{module_name}` module."
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or not callable(obj):
                continue
            if getattr(obj, "__module__", None) not in (module_name, f"_{module_name}", None):
                continue  # a name the module imported from elsewhere
            with warnings.catch_warnings():  # typing.io and typing.re warn on every access
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = (inspect.getdoc(obj) or "").strip().splitlines()
            if not doc or len(doc[0]) < 12:
                continue
            name = f"{module_name}.{attr}"
            for template in templates:
                yield "stdlib", template.format(name=name, doc=doc[0].rstrip())


def arithmetic_questions(rng: random.Random, count: int) -> Iterator[tuple[str, str]]:
    """(family, question): `count` arithmetic questions over seeded random numbers."""
    makers = (
        lambda a, b: f"What is {a} plus {b}?",
        lambda a, b: f"What is {a} times {b}?",
        lambda a, b: f"What is {a + b} minus {b}?",
        lambda a, b: f"What is {a * b} divided by {b}?",
        lambda a, b: f"Calculate {a} + {b} * {b % 9 + 2}.",
        lambda a, b: f"What is {b % 50 + 5}% of {a * 10}?",
        lambda a, b: f"What is the square root of {(a % 30 + 2) ** 2}?",
        lambda a, b: f"Is {a * 7 + b} a prime number?",
        lambda a, b: (f"A shop sells apples for {b % 9 + 1} dollars each. How much do {a % 20 + 2} "
                      "apples cost?"),
        lambda a, b: (f"If I have {a + b} marbles and give away {b}, how many marbles do I have "
                      "left?"),
        lambda a, b: (f"A train travels {a * 3} kilometers in {b % 5 + 2} hours. What is its "
                      "average speed?"),
        lambda a, b: f"What is {a} squared?",
    )
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        yield "arithmetic", rng.choice(makers)(a, b)


def knowledge_questions() -> Iterator[tuple[str, str]]:
    """(family, question): facts, explanations, meanings, poems, stories and advice."""
    for country in COUNTRIES:
        yield "knowledge", f"What is the capital of {country}?"
        yield "knowledge", f"What languages are spoken in {country}?"
        yield "knowledge", f"Tell me a few interesting facts about {country}."
    for concept in CONCEPTS:
        yield "knowledge", f"Explain {concept} in simple terms."
        yield "knowledge", f"What is {concept}?"
        yield "knowledge", f"Give me three facts about {concept}."
    for thing in THINGS:
        yield "knowledge", f"Write a haiku about {thing}."
        yield "knowledge", f"Write a short poem about {thing}."
        yield "knowledge", f"Write a very short story about {thing}."
    for activity in ACTIVITIES:
        yield "knowledge", f"Give me three tips for {activity}."
        yield "knowledge", f"How do I get better at {activity}?"
    for word in WORDS:
        yield "knowledge", f"What does the word '{word}' mean? Use it in a sentence."


def coding_questions() -> Iterator[tuple[str, str]]:
    """(family, question): code to write, concepts to compare or explain."""
    for i, task in enumerate(CODING_TASKS):
        yield "coding", f"Write a Python function that {task}."
        yield "coding", f"Write a {LANGUAGES[i % len(LANGUAGES)]} function that {task}."
        yield "coding", f"How would I write code that {task}? Explain the steps."
    for a, b in COMPARISONS:
        yield "coding", f"What is the difference between {a.strip()} and {b}?"
    for topic in PROGRAMMING_TOPICS:
        yield "coding", f"Explain {topic} in programming, with an example."
        yield "coding", f"What is {topic} in Python?"


def is_heldout(question: str) -> bool:
    """The split a question belongs to: a stable hash of its text, one in HELDOUT_EVERY."""
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELDOUT_EVERY == 0


def questions(split: str, seed: int = 0, num_arithmetic: int = 600) -> list[dict[str, str]]:
    """Every question of `split` ("train" or "heldout"), deduplicated: [{"family": ...,
    "question": ...}]. Each family is shuffled by `seed` and the families are interleaved,
    so that any prefix of the list (a tool's time box) is balanced across them until the
    smaller families run out."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, got {split!r}")
    rng = random.Random(seed)
    seen: set[str] = set()
    by_family: dict[str, list[str]] = {}
    for family, question in (*stdlib_questions(), *arithmetic_questions(rng, num_arithmetic),
                             *knowledge_questions(), *coding_questions()):
        if question in seen or is_heldout(question) != (split == "heldout"):
            continue
        seen.add(question)
        by_family.setdefault(family, []).append(question)
    for family_questions in by_family.values():
        rng.shuffle(family_questions)
    longest = max(len(q) for q in by_family.values())
    return [{"family": family, "question": qs[i]} for i in range(longest)
            for family, qs in by_family.items() if i < len(qs)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", choices=("train", "heldout"), default="train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSONL file, one question a line")
    args = p.parse_args(argv)
    rows = questions(args.split, args.seed)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["family"]] = counts.get(row["family"], 0) + 1
    print(f"wrote {len(rows)} {args.split} questions to {args.out}: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
