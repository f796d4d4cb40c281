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
