"""The decode loops and their policies: `decoding` (generate, stream, SpeculativeDecoder), `batch` (rows
joining and leaving), `adaptive` (gamma="auto"), `text` (text in, text out)."""
