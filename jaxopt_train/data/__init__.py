"""jaxopt_train.data: byte-level corpora, token files, images, synthetic batches, sharding."""

from jaxopt_train.data.images import ImageDataset as ImageDataset
from jaxopt_train.data.images import check_labels as check_labels
from jaxopt_train.data.images import load_image_npz as load_image_npz
from jaxopt_train.data.sharding import process_batch_slice as process_batch_slice
from jaxopt_train.data.sharding import shard_batch as shard_batch
from jaxopt_train.data.synthetic import synthetic_image_batch as synthetic_image_batch
from jaxopt_train.data.synthetic import synthetic_lm_batch as synthetic_lm_batch
from jaxopt_train.data.text import corpus_lm_batch as corpus_lm_batch
from jaxopt_train.data.text import load_text_corpus as load_text_corpus
from jaxopt_train.data.text import stdlib_source_files as stdlib_source_files
from jaxopt_train.data.tokens import TokenDataset as TokenDataset
from jaxopt_train.data.tokens import check_token_width as check_token_width
from jaxopt_train.data.tokens import load_token_file as load_token_file
from jaxopt_train.data.tokens import max_token_id as max_token_id
