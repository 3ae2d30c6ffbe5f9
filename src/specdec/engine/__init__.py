"""The decode engine: one round over rows (`round`), the target over rows (`targets`), verification, proposals,
a request's options and row (`options`, `request`), the pairing and γ rules (`pairing`, `policies`); a lone request
(`decoding`: generate, stream, SpeculativeDecoder) and a batch (`batch`); `adaptive` (gamma="auto"), `text`."""
