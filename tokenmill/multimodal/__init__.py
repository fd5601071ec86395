"""Images (and later audio) as prompt inputs: decoding and limits (`media_io`), each family's preprocessing and
placeholder tokens (`processing`), and the wire form of one item (`inputs`)."""
