"""covering.py in this process (milliseconds): what the array makes of a seam that the check refuses whatever the
rest of its cell is."""

import covering


def test_a_seam_refused_by_an_earlier_cells_refusal_is_named_on_that_refused_cell():
    """A stream that switches format is refused by the check with any task (its reader stops at the switch): the
    first seam that meets it reduces the refusal to {data: switch} alone, and the seam of that very value then
    clashed with the forbidden set and was listed as not coverable, its cell unnamed. It is that refused cell."""
    dimensions = {"task": ("lm", "sft", "grpo"), "data": ("padded", "switch", "stream"), "arch": ("gpt2", "qwen2")}

    def refused(values):  # (grpo refuses padded rows here so that its seam's second try takes the switch first)
        if values["data"] == "switch":
            return "data: the stream switches format"
        return "data: grpo streams" if values["task"] == "grpo" and values["data"] == "padded" else None

    seams = (("grpo on qwen2", {"task": "grpo", "arch": "qwen2"}),
             ("a stream whose files switch format", {"task": "sft", "data": "switch"}))
    array = covering.covering_array(dimensions, refused, seams, seed=0)
    named = {seam: (values, message) for values, message, seam in array.cells if seam}
    assert named["a stream whose files switch format"] == ({"task": "lm", "data": "switch", "arch": "gpt2"},
                                                           "data: the stream switches format"), array.cells
    assert not any(dict(p) == seams[1][1] for p in array.uncoverable), array.uncoverable


def test_a_refusal_whose_base_value_is_refused_for_another_cause_leaves_no_pair_uncovered():
    """TP is refused with GPT-2 (the base architecture: no plan) and, for another field, with compiling. A cell
    refused for compiling under TP on Llama used to reduce by GPT-2, read TP's own refusal as its cause, record
    {tp, gpt2} again and try the same cell until the rounds ran out: its pairs were left in no cell (267 in the
    matrix). Reduced by the refusal's field, the set is {tp, llama, compile}, and TP x compile is refused in every
    cell (each architecture completes a forbidden set)."""
    dimensions = {"layout": ("one", "tp"), "arch": ("gpt2", "llama"), "speed": ("none", "compile")}

    def refused(values):
        if values["layout"] == "tp" and values["arch"] == "gpt2":
            return "tp_size: gpt2 has no tensor-parallel plan"
        return "torch_compile: not under tp" if values["layout"] == "tp" and values["speed"] == "compile" else None

    array = covering.covering_array(dimensions, refused, seed=0)
    assert not array.uncoverable, array.uncoverable
    assert (("layout", "tp"), ("speed", "compile")) in array.refused_pairs
    assert {"layout": "tp", "arch": "llama", "speed": "none"} in [v for v, message, _ in array.cells if message is None]
