# SPDX-License-Identifier: Apache-2.0
"""Quality suite for KV-cache dtypes on vLLM (see eval/README.md); run it with eval/run_quality.py."""
