"""Byte-level formats, read and written without torch: the torch zip container, torch pickles
(strict and lenient readers, a writer), legacy torch files, safetensors, and the dtype table.

Nothing here imports torch or decides what a path is (``layouts`` does).
"""
