"""The pipeline runtime (design.md §4): module servers exchanging calls between stages."""
