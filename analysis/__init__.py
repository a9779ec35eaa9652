"""The science as a library: measures, null distributions, probes and attention splits."""
