# SPDX-License-Identifier: Apache-2.0
"""Fixtures shared by the integration tests."""

import pytest


@pytest.fixture
def model_gguf(tmp_path):
    """A small GGUF laid out as a model file: metadata, then the data of two float tensors (tmp_path/m.gguf)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    w.add_tensor("token_embd.weight", np.arange(576 * 36, dtype=np.float32).reshape(576, 36))
    w.add_tensor("output_norm.weight", np.ones(36, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
