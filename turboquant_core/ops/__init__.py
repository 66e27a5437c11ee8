# SPDX-License-Identifier: Apache-2.0
"""Launchers for the Triton kernels: input checks, allocation, grids, cached constants."""
