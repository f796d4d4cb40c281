"""Writes tests/data/bpe-2048/tokenizer.json, the tests' tiny models' tokenizer (conftest's ``bpe_2048``): the
2048-token byte-level BPE of ``toolkit.models.offline.pydoc_bpe_tokenizer``, trained on the running Python's pydoc text.
The shipped file was written on Python 3.11; run this only to change the tokenizer on purpose (figures in the tests,
like the DPO battery's long-prompt token count, follow it).

    python tests/scripts/write_bpe.py
"""

import os

from toolkit.models.offline import pydoc_bpe_tokenizer

if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "bpe-2048",
                        "tokenizer.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pydoc_bpe_tokenizer(2048).backend_tokenizer.save(path)
    print(path)
