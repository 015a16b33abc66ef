// Renders a chat template the way llama.cpp's common_chat_template_direct_apply_impl does:
// messages normalized by the template's caps, bos/eos tokens, enable_thinking always defined,
// add_generation_prompt only when true. Input: argv[1] template, stdin a JSON object
// {"messages":[...], "add_generation_prompt":bool, "enable_thinking":bool, "bos_token":s, "eos_token":s}.
#include "jinja/lexer.h"
#include "jinja/parser.h"
#include "jinja/runtime.h"
#include "jinja/caps.h"
#include "jinja/value.h"
#include "json.h"
#include <fstream>
#include <iostream>
#include <sstream>

int main(int argc, char ** argv) {
    std::ifstream f(argv[1]);
    std::stringstream ss; ss << f.rdbuf();
    std::string src = ss.str();
    std::stringstream in; in << std::cin.rdbuf();
    common_json req = common_json::parse(in.str());
    jinja::lexer lexer;
    auto lexer_res = lexer.tokenize(src);
    jinja::program prog = jinja::parse_from_tokens(lexer_res);
    jinja::caps caps = jinja::caps_get(prog);
    common_json messages = req.at("messages");
    bool only_typed = !caps.supports_string_content && caps.supports_typed_content;
    if (only_typed) { std::cerr << "template wants typed content; not handled\n"; return 2; }
    common_json inp = common_json::object();
    inp["messages"] = messages;
    inp["bos_token"] = req.at("bos_token");
    inp["eos_token"] = req.at("eos_token");
    inp["enable_thinking"] = req.at("enable_thinking");
    if (req.contains("tools")) inp["tools"] = req.at("tools");
    if (req.at("add_generation_prompt").get<bool>()) inp["add_generation_prompt"] = true;
    jinja::context ctx(lexer_res.source);
    jinja::global_from_json(ctx, inp, false);
    jinja::runtime runtime(ctx);
    const jinja::value results = runtime.execute(prog);
    auto parts = jinja::runtime::gather_string_parts(results);
    std::cout << parts->as_string().str();
    return 0;
}
