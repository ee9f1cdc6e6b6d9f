"""PLACEHOLDER (helper H1 replaces this file): the slow-link detector."""


def detector(cfg, grid):
    return None
