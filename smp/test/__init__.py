"""SMP v1's ``test`` package path, for scripts that import its debugging helpers."""
