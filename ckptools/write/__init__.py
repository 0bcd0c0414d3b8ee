"""The write wing: everything that puts a checkpoint's bytes on disk."""
