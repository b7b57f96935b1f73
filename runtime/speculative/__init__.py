"""Speculative decoding: drafters that guess several tokens for the model to verify in one forward
(the scheduler's SpecManager verifies them). NGRAM: prompt lookup, no model."""
