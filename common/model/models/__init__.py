"""Model families, one file each, composed from common/model/layers/; found by their
`architectures` name through common/model/registry.py."""
