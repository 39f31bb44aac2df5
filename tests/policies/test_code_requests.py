"""code_score's request-for-code signal: a request that asks for code in words ("Write a C++ program...") lands in
the code slice though it holds no code, and prose that merely mentions a program does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies.features import asks_for_code, code_score, features_from_openai
from policies.load import load_policy_file
from policies.slicing import classify
from replay.workloads import load_all


DEFAULT = Path(__file__).resolve().parents[2] / "deploy/policies/default.yaml"


@pytest.mark.parametrize("text", [
    "Write a C++ program to find the nth Fibonacci number using recursion.",
    "Implement a function to find the median of two sorted arrays of different sizes.",
    "Develop a Python program that reads all the text files under a directory.",
    "Write a simple website in HTML. When a user clicks the button, it shows a random joke.",
    "Help me create an exponential decay scoring function for an Elasticsearch query.",
    "could you fix this script for me",
    "How do I sort a list of tuples in Python?",
    "Implement a program to find the common elements in two arrays.",  # an everyday noun after implement
    "Write an R script that plots a histogram.",  # ... after a language
    "Write a SQL query that counts the users per country.",
])
def test_a_request_for_code_in_words_is_one(text: str) -> None:
    assert asks_for_code(text)


@pytest.mark.parametrize("text", [
    "Write a persuasive essay about the value of a good program of study.",  # program, but six words on
    "Write a short story about a robot who learns to paint.",
    "The old bike was covered in rust and the chain had snapped.",  # a language, but not capitalised
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Prefix the code with your employee number.",  # 'fix' inside a word is not the verb
    "Write a script for a YouTube video about cooking.",  # everyday nouns, no language, no implement
    "Develop a training program for new employees.",
    "Create a class schedule for next semester.",
    "Write a query letter to a literary agent.",
    "Write an essay about the function of the kidneys.",  # a preposition between the verb and the noun
    "Write a code of conduct for our volunteers.",
    "",
])
def test_prose_is_not(text: str) -> None:
    assert not asks_for_code(text)


def test_it_adds_half_to_the_look_of_code_capped_at_one() -> None:
    ask = "Write a C++ program to find the nth Fibonacci number using recursion."
    plain = "Wrote a C++ program to find the nth Fibonacci number using recursion."  # the same marks, no ask
    assert code_score(ask) == round(code_score(plain) + 0.5, 4) == 0.5522
    fenced = "Write a Python function like this one:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert code_score(fenced) == 1.0


def test_only_the_first_and_last_thousand_characters_are_read() -> None:
    filler = "The committee met on Tuesday to discuss the budget at length. " * 40  # 2,520 characters
    ask = "Write a Python script that merges these files."
    assert not asks_for_code(filler + ask + filler)
    assert asks_for_code(filler + ask) and asks_for_code(ask + filler)


def test_the_default_policy_puts_every_sample_coding_question_in_the_code_slice() -> None:
    """The repository's sample holds all six Spec-Bench (MT-bench) coding questions of the shared set, none with
    code in it: every one asks for code, every one is classified code, and no prose question moves to code."""
    policy = load_policy_file(DEFAULT)
    items = load_all()
    coding = [item for item in items["code"] if item.source == "spec_bench/coding"]
    prose = items["prose"]
    assert len(coding) == 6 and len(prose) == 66
    slices = [classify(policy, features_from_openai({"model": "m", "messages": i.messages}))[0] for i in coding]
    assert slices == ["code"] * 6
    assert sum(asks_for_code(i.messages[-1]["content"]) for i in coding) == 6
    assert {classify(policy, features_from_openai({"model": "m", "messages": i.messages}))[0] for i in prose} == {"prose"}
