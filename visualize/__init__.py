"""Dot rendering, partition maps, plots and trace summaries."""
