"""flashledger inside other libraries' models.

- ``flashledger.integrations.transformers``: an attention backend for Hugging
  Face transformers models (``register()``), needs ``pip install
  flashledger[transformers]``.
"""
