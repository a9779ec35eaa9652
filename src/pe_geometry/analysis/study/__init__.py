"""The study's verdicts: arms against nulls, controls and sizes, and the planned experiments' tests."""
