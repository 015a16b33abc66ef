// llama.cpp's own multimodal path (tools/mtmd), as llama-mtmd-cli and llama-server run it, for
// goldens of dasllama's vision towers: the image's embeddings (mtmd_encode_chunk), the prompt's
// text chunks as mtmd tokenizes them, then the whole prompt evaluated with
// mtmd_helper_eval_chunks (image rows decoded non-causally where mtmd does it) and a few greedy
// steps after it, each step's full logits.
//
//   mtmd_golden TEXT.gguf MMPROJ.gguf IMAGE.rgb WIDTH HEIGHT "prompt with <__media__>" N_STEPS > out.json
//
// IMAGE.rgb: WIDTH * HEIGHT * 3 bytes, row by row (no decoding here: the test feeds dasllama the
// same pixels). Built by scripts/make_vision_goldens.py against a static build of the sdist.
#include "llama.h"
#include "mtmd.h"
#include "mtmd-helper.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

static void put_floats(const float * x, size_t n) {
    std::printf("[");
    for (size_t i = 0; i < n; i++) {
        std::printf(i ? ",%.9g" : "%.9g", x[i]);
    }
    std::printf("]");
}

int main(int argc, char ** argv) {
    if (argc != 8) {
        std::fprintf(stderr, "usage: %s TEXT.gguf MMPROJ.gguf IMAGE.rgb W H PROMPT N_STEPS\n", argv[0]);
        return 2;
    }
    const int w = std::atoi(argv[4]), h = std::atoi(argv[5]), steps = std::atoi(argv[7]);
    std::ifstream f(argv[3], std::ios::binary);
    std::vector<unsigned char> rgb((size_t) w * h * 3);
    f.read((char *) rgb.data(), (std::streamsize) rgb.size());
    if ((size_t) f.gcount() != rgb.size()) {
        std::fprintf(stderr, "short image file\n");
        return 2;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 3;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    llama_context * lctx = llama_init_from_model(model, cp);
    mtmd_context_params vp = mtmd_context_params_default();
    vp.use_gpu = false;
    vp.n_threads = 1;
    vp.warmup = false;
    vp.print_timings = false;
    mtmd_context * vctx = mtmd_init_from_file(argv[2], model, vp);
    if (!vctx) return 4;

    mtmd_bitmap * bmp = mtmd_bitmap_init((uint32_t) w, (uint32_t) h, rgb.data());
    mtmd_input_chunks * chunks = mtmd_input_chunks_init();
    mtmd_input_text txt = {argv[6], std::string(argv[6]).size(), true, true};
    const mtmd_bitmap * bitmaps[] = {bmp};
    if (mtmd_tokenize(vctx, chunks, &txt, bitmaps, 1) != 0) return 5;

    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const int n_embd = llama_model_n_embd_inp(model);
    std::printf("{\"chunks\":[");
    for (size_t i = 0; i < mtmd_input_chunks_size(chunks); i++) {
        const mtmd_input_chunk * c = mtmd_input_chunks_get(chunks, i);
        std::printf(i ? "," : "");
        if (mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_TEXT) {
            size_t n = 0;
            const llama_token * t = mtmd_input_chunk_get_tokens_text(c, &n);
            std::printf("{\"text\":[");
            for (size_t j = 0; j < n; j++) std::printf(j ? ",%d" : "%d", t[j]);
            std::printf("]}");
        } else {
            if (mtmd_encode_chunk(vctx, c) != 0) return 6;
            const size_t n = mtmd_input_chunk_get_n_tokens(c);
            std::printf("{\"image\":%zu,\"embd\":", n);
            put_floats(mtmd_get_output_embd(vctx), n * n_embd);
            std::printf("}");
        }
    }
    std::printf("],\"non_causal\":%s", mtmd_decode_use_non_causal(vctx, nullptr) ? "true" : "false");
    llama_pos n_past = 0;
    if (mtmd_helper_eval_chunks(vctx, lctx, chunks, 0, 0, 512, true, &n_past) != 0) return 7;
    std::printf(",\"n_past\":%d,\"steps\":[", n_past);
    for (int s = 0; s < steps; s++) {
        const float * lg = llama_get_logits_ith(lctx, -1);
        int best = 0;
        for (int v = 1; v < n_vocab; v++) if (lg[v] > lg[best]) best = v;
        std::printf(s ? ",{\"token\":%d,\"logits\":" : "{\"token\":%d,\"logits\":", best);
        put_floats(lg, n_vocab);
        std::printf("}");
        llama_token t = best;
        llama_batch b = llama_batch_get_one(&t, 1);
        if (llama_decode(lctx, b) != 0) return 8;
    }
    std::printf("]}\n");
    mtmd_input_chunks_free(chunks);
    mtmd_bitmap_free(bmp);
    mtmd_free(vctx);
    llama_free(lctx);
    llama_model_free(model);
    return 0;
}
