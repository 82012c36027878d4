"""Wire messages and codecs. PURE: values and bytes only, no sockets."""
