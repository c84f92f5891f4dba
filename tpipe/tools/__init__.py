"""Measurement: the HLO reader, ahead-of-time analysis of compiled steps, schedule timelines."""
