"""bitpress.errors.summarize_names / summarize_problems: one sentence for many tensors, not one per tensor."""

from __future__ import annotations

from bitpress.errors import summarize_names, summarize_problems


def test_summarize_names_counts_what_it_leaves_out() -> None:
    names = [f"model.layers.{i}.self_attn.q_proj" for i in range(47)]
    assert summarize_names(names) == ("model.layers.0.self_attn.q_proj, model.layers.1.self_attn.q_proj, "
                                      "model.layers.2.self_attn.q_proj and 44 more")
    assert summarize_names(["a", "b"]) == "a, b"
    assert summarize_names(["a", "b", "c"]) == "a, b, c"
    assert summarize_names(["a", "a", "b", "c", "d"], limit=2) == "a, b and 2 more"  # repeats count once
    assert summarize_names([]) == ""


def test_summarize_problems_groups_names_by_reason_in_first_seen_order() -> None:
    problems = [(f"w{i}", "is 2-bit") for i in range(5)] + [("x", "is 3-D"), ("w5", "is 2-bit")]
    assert summarize_problems(problems) == "6 tensors (w0, w1, w2 and 3 more): is 2-bit; x: is 3-D"
    assert summarize_problems([("a", "r")], noun="blocks") == "a: r"
    assert summarize_problems([("a", "r"), ("b", "r")], noun="blocks", limit=1) == "2 blocks (a and 1 more): r"
    assert summarize_problems([]) == ""
