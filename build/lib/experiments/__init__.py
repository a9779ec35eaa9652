"""The science: geometry measures, pretrained-checkpoint analysis, reports."""
