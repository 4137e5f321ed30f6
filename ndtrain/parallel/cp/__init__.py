"""Context parallel: ring attention (online softmax) and Ulysses all-to-all."""
