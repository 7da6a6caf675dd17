"""Executables: run a lowered Program over flat tensor leaves."""
